"""The rules stage: deterministic patterns that block clear cases, terms that clear, and a size limit.

Rules are the cascade's first stage and its deterministic fallback when a model guard fails, so they only
block what is unambiguous; anything else scores 0.5 ("unsure") and the cascade passes it on. They read text
after normalisation (NFKC, invisible characters removed, casefolded, whitespace collapsed) and also after
folding common Cyrillic and Greek look-alikes to Latin, so fullwidth letters, zero-width joiners and
homoglyphs do not slip past a pattern.

A rule's `applies_to` says which spans it reads:

    untrusted   the untrusted spans of an input (user text, tool results, documents): injection patterns,
                which the tenant's own trusted system prompt legitimately resembles ("ignore prior rules...")
    input       every span of an input
    all         every span of an input and of an output

Patterns match within one span: a match across the joint of two spans would be text nobody wrote.
"""

from __future__ import annotations

import asyncio
import re
import time
import unicodedata
from concurrent.futures import Executor
from typing import Literal

from guard.base import GuardInput, GuardScore, Span
from guard.prefilter import Prefilter
from registry.models import RulePattern, RulesSpec

__all__ = ["RulesClassifier", "default_rules", "normalise"]

# Characters that render as nothing (zero-width space/joiners, soft hyphen, bidi controls, word joiner,
# BOM, Unicode tag characters used to smuggle hidden ASCII). They split words so a pattern misses; drop them.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e007f]"
)
_SPACE = re.compile(r"\s+")
# Cyrillic and Greek letters that look like Latin ones (lowercase: applied after casefolding).
_CONFUSABLES = str.maketrans(
    "\u0430\u0432\u0435\u0451\u0456\u0457\u0458\u043a\u043c\u043d\u043e\u0440"
    "\u0441\u0442\u0443\u0445\u0455\u0501\u04bb\u04cf\u051b\u051d\u03b1\u03b2"
    "\u03b5\u03b7\u03b9\u03ba\u03bd\u03bf\u03c1\u03c4\u03c5\u03c7\u03f2\u03f3",
    "abeeiijkmhopctyxsdhlqwabenikvoptuxcj",
)


def normalise(text: str) -> str:
    """`text` as rules read it: NFKC, invisible characters removed, casefolded, whitespace collapsed."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))
    # Casefolding can produce non-NFKC text (and NFKC non-casefolded text), hence NFKC on both sides.
    text = unicodedata.normalize("NFKC", text.casefold())
    return _SPACE.sub(" ", text).strip()


def _views(text: str) -> tuple[str, ...]:
    """The normalised text, and its Latin skeleton when look-alike letters change it."""
    plain = normalise(text)
    skeleton = plain.translate(_CONFUSABLES)
    # Both: a tenant's rule in Cyrillic or Greek must still match the text as written.
    return (plain,) if skeleton == plain else (plain, skeleton)


def _compile_term(term: str) -> re.Pattern[str]:
    """A plain term as a pattern: literal, normalised like the text, bounded where it starts/ends a word."""
    norm = normalise(term)
    if not norm:
        raise ValueError(f"empty rule term {term!r}")
    body = re.escape(norm)
    # Lookarounds instead of \b so a term that starts or ends with punctuation still matches next to a word.
    head = r"(?<!\w)" if re.match(r"\w", norm[0]) else ""
    tail = r"(?!\w)" if re.match(r"\w", norm[-1]) else ""
    return re.compile(head + body + tail)


def _compile(rule: RulePattern) -> re.Pattern[str]:
    """A rule's pattern. Regexes read casefolded text: write their literals in lower case ("ss", not "ß")."""
    if not rule.regex:
        return _compile_term(rule.pattern)
    # NFKC (not casefold) only: casefolding a regex would change escapes such as \S into \s.
    return re.compile(unicodedata.normalize("NFKC", rule.pattern), re.IGNORECASE)


class _Rule:
    """A compiled block rule, with its position in the spec (what the audit records)."""

    __slots__ = ("applies_to", "category", "index", "joined", "regex")

    def __init__(self, index: int, rule: RulePattern) -> None:
        self.index = index
        self.category = rule.category
        self.applies_to = rule.applies_to
        self.regex = _compile(rule)
        # Whether the stage's prefilter covers it (`_prefilter`); one that refers to its own groups runs
        # on its own.
        self.joined = _BACKREFERENCE.search(self.regex.pattern) is None


# What a span is to the rules: an output's, an input's trusted one, an input's untrusted one (`_reads`).
_Reader = Literal["output", "trusted", "untrusted"]
_READERS: dict[_Reader, frozenset[str]] = {
    "output": frozenset({"all"}),
    "trusted": frozenset({"all", "input"}),
    "untrusted": frozenset({"all", "input", "untrusted"}),
}
# A pattern whose meaning depends on its own group numbers or names, which joining it to others would change.
_BACKREFERENCE = re.compile(r"\\[1-9]|\\g<|\(\?P=")


def _reader(item: GuardInput, span: Span) -> _Reader:
    if item.direction == "output":
        return "output"
    return "trusted" if span.trusted else "untrusted"


def _prefilter(rules: tuple[_Rule, ...], applies: frozenset[str]) -> Prefilter | None:
    """One scan telling whether any of `rules` that read spans of this kind (`applies`) may match, or None
    when they cannot be joined into one (`guard.prefilter`). Rules that refer to their own groups are left
    out of it and always run (`_Rule.joined`)."""
    patterns = [r.regex.pattern for r in rules if r.joined and r.applies_to in applies]
    if not patterns:
        return None
    try:
        return Prefilter(patterns)
    except re.error:  # e.g. a global inline flag inside a pattern, or two groups of one name
        return None


class RulesClassifier:
    """The rules stage as a Classifier: 1.0 on a block rule or oversized input, 0.0 on an allow term, or 0.5.

    Patterns are compiled once here; an invalid regex fails construction (re.error), never a request. The
    block rules are also joined into one prefilter per kind of span (`_prefilter`, `guard.prefilter`): a span
    it does not match is skipped by every joined rule, so benign text costs one scan instead of one per rule,
    and ASCII text one scan matched as written (the starter set on a 20-word prompt: 6-8 us the scan, against
    29-45 us for one case-insensitive scan and 71 us for the rules one by one).
    Matching takes about 0.4 us per character with the default rules (a 2-core EPYC: 1,024 characters
    0.39 ms, 64 KiB 24 ms): an item of more than `inline_chars` characters is matched in `executor` when one
    is given, so a long document does not stall the event loop (`re` holds the GIL through each search, but
    the loop gets it back between searches).
    """

    def __init__(
        self,
        rules: RulesSpec,
        categories: tuple[str, ...] = (),
        name: str = "rules",
        *,
        executor: Executor | None = None,
        inline_chars: int = 1_024,
    ) -> None:
        self.name = name
        self.max_input_chars = rules.max_input_chars
        # A rule of a category this stage does not judge is dropped (empty `categories`: all of them).
        self._block = tuple(
            _Rule(i, r) for i, r in enumerate(rules.block) if not categories or r.category in categories
        )
        self._allow = tuple(_compile_term(t) for t in rules.allow)
        self._prefilters = {kind: _prefilter(self._block, applies) for kind, applies in _READERS.items()}
        self._executor = executor
        self._inline_chars = inline_chars

    async def classify(self, item: GuardInput) -> GuardScore:
        """Score `item` deterministically (the same item always gets the same score)."""
        start = time.perf_counter()
        if self._executor is not None and sum(len(s.text) for s in item.spans) > self._inline_chars:
            loop = asyncio.get_running_loop()
            p_unsafe, category, raw = await loop.run_in_executor(self._executor, self.score_sync, item)
        else:
            p_unsafe, category, raw = self.score_sync(item)
        return GuardScore(
            p_unsafe=p_unsafe,
            category=category,
            guard=self.name,
            latency_s=time.perf_counter() - start,
            raw=raw,
        )

    def score_sync(self, item: GuardInput) -> tuple[float, str, dict[str, float | str]]:
        """P(unsafe), category and audit details of `item`, in the caller's thread."""
        # The spans an allow term and the size limit look at: an input's untrusted ones, all of an output.
        judged = [i for i, s in enumerate(item.spans) if item.direction == "output" or not s.trusted]
        if (
            item.direction == "input"
            and self.max_input_chars > 0
            and sum(len(item.spans[i].text) for i in judged) > self.max_input_chars
        ):
            # Checked first: an oversized input is refused without spending regex time on it.
            return 1.0, "", {"reason": "max_input_chars"}
        views: dict[int, tuple[str, ...]] = {}  # by span position: each span normalised at most once
        hit = self._first_block(item, views)
        if hit is not None:
            # Only the rule's index and category: matched text would put prompt content in the audit log.
            return 1.0, hit.category, {"reason": "block", "rule": hit.index, "category": hit.category}
        if self._allowed(item, judged, views):
            # Only judged spans: the tenant's fixed system prompt would otherwise clear every request.
            return 0.0, "", {"reason": "allow"}
        return 0.5, "", {"reason": "unsure"}

    def _first_block(self, item: GuardInput, views: dict[int, tuple[str, ...]]) -> _Rule | None:
        """The first block rule (in spec order: deterministic) that matches a span it reads."""
        # Spans the prefilter clears match no joined rule: those rules skip them.
        maybe = [self._maybe(item, i, span, views) for i, span in enumerate(item.spans)]
        for rule in self._block:
            for i, span in enumerate(item.spans):
                if (
                    (maybe[i] or not rule.joined)
                    and _reads(rule.applies_to, item, span)
                    and any(rule.regex.search(v) for v in _cached_views(views, i, span))
                ):
                    return rule
        return None

    def _maybe(self, item: GuardInput, i: int, span: Span, views: dict[int, tuple[str, ...]]) -> bool:
        """Whether a joined rule may match span `i` (False only when the prefilter matched none of its
        views)."""
        prefilter = self._prefilters[_reader(item, span)]
        return prefilter is None or any(prefilter.may_match(v) for v in _cached_views(views, i, span))

    def _allowed(self, item: GuardInput, judged: list[int], views: dict[int, tuple[str, ...]]) -> bool:
        """Whether an allow term appears in one of the judged spans."""
        return any(
            term.search(v)
            for i in judged
            for v in _cached_views(views, i, item.spans[i])
            for term in self._allow
        )


def _cached_views(views: dict[int, tuple[str, ...]], i: int, span: Span) -> tuple[str, ...]:
    """The views of span `i`, computed on first use."""
    if i not in views:
        views[i] = _views(span.text)
    return views[i]


def _reads(applies_to: str, item: GuardInput, span: Span) -> bool:
    """Whether a rule with `applies_to` reads `span` of `item`."""
    if item.direction == "output":
        return applies_to == "all"
    return applies_to != "untrusted" or not span.trusted


def _rx(category: str, pattern: str, applies_to: Literal["untrusted", "input", "all"] = "all") -> RulePattern:
    """A regex block rule (a helper for the starter set)."""
    return RulePattern(category=category, pattern=pattern, regex=True, applies_to=applies_to)


# Whom a violent verb must target before a rule calls it violence: "kill a process", "kill weeds" and "how do
# I kill them" (ants, in context) do not. Pronouns are left out for that reason.
_PERSON = (
    r"(?:someone|somebody|anyone|people|a (?:person|child|kid|man|woman|cop|police officer)"
    r"|my (?:wife|husband|partner|boyfriend|girlfriend|mom|mother|dad|father|brother|sister|boss|coworker"
    r"|neighbou?r|teacher|classmates?|ex))"
)
_ASK = (
    r"(?:how (?:do|can|could|should|would) i|how to|help me|ways to|best way to"
    r"|i (?:want|need|am going) to)"
)
_HOW_TO = r"(?:how (?:do|can) i|how to|help me|instructions to|steps to)"
# Security work names malware too ("build a rootkit detector"): those are not requests for malware.
_DEFENSIVE = r"(?! (?:detector|scanner|detection|removal|remover|protection|defen[cs]e|analysis))"


def default_rules() -> RulesSpec:
    """A small starter set: clear requests for violence, self-harm, weapons, malware; injection phrases.

    English with German, French and Spanish for the most common phrasings. Every rule needs a harmful object
    or target, so benign look-alikes ("kill a process", "shoot a photo", "make a bath bomb") stay unsure
    rather than blocked. Injection rules read untrusted spans only.
    """
    injection = (
        r"\b(?:ignore|disregard|forget|override) (?:all )?(?:of )?(?:the |your |any )?"
        r"(?:previous|prior|above|earlier|preceding) (?:instructions|prompts?|directions|rules)\b",
        r"\b(?:ignore|disregard|forget) (?:the |your )?system prompt\b",
        r"\byou are now (?:dan|in developer mode|jailbroken)\b|\bdo anything now\b",
        r"\b(?:reveal|print|show|repeat|output|leak|display) (?:me )?(?:your|the) "
        r"(?:system prompt|initial instructions|hidden instructions)\b",
        r"\b(?:ignoriere|ignorier|vergiss|missachte) (?:alle )?(?:vorherigen|bisherigen|obigen|vorigen) "
        r"(?:anweisungen|instruktionen|befehle)\b",
        r"\b(?:ignore[zr]?|oublie[zr]?) (?:toutes )?(?:les|tes|vos) instructions "
        r"(?:précédentes|ci-dessus|antérieures)\b",
        r"\b(?:ignora|ignore|olvida|olvide) (?:todas )?(?:las|tus|sus) instrucciones "
        r"(?:anteriores|previas)\b",
    )
    harmful = {
        "violence": (
            rf"\b{_ASK} (?:kill|murder|stab|strangle|poison) {_PERSON}\b",
            r"\bwie (?:kann|könnte) ich (?:jemanden|einen menschen|meine[nr]? (?:frau|mann|chef|nachbarn?)) "
            r"(?:töten|umbringen|ermorden|vergiften)\b",
            r"\bcomment (?:tuer|assassiner|empoisonner) "
            r"(?:quelqu'un|ma femme|mon mari|mon patron|mon voisin)\b",
            r"\bc[oó]mo (?:matar|asesinar|envenenar) a (?:alguien|mi (?:esposa|esposo|jefe|vecino))\b",
            r"\b(?:plan|planning) (?:a|the) (?:school|mass) shooting\b",
        ),
        "self_harm": (
            r"\b(?:how (?:do|can|should) i|how to|ways to|help me) "
            r"(?:kill myself|commit suicide|end my (?:own )?life)\b",
            r"\b(?:painless|surest) (?:way|method)s? to (?:die|kill myself|commit suicide|end my life)\b",
            r"\b(?:easiest|quickest|fastest|best) (?:way|method)s? to "
            r"(?:kill myself|commit suicide|end my life)\b",
            r"\bwie (?:bringe ich mich um|töte ich mich|kann ich mich umbringen)\b",
            r"\bcomment (?:me suicider|mettre fin à mes jours)\b",
            r"\bc[oó]mo (?:suicidarme|quitarme la vida|matarme)\b",
        ),
        "weapons": (
            rf"\b{_HOW_TO} (?:make|build|assemble|construct) (?:a |an )?"
            r"(?:pipe bomb|nail bomb|dirty bomb|bomb|explosive device|ied|molotov cocktail)s?(?![\w-])",
            r"\b(?:synthesi[sz]e|make|produce|weaponi[sz]e) "
            r"(?:sarin|vx nerve agent|tabun|ricin|anthrax|mustard gas|a nerve agent)\b",
            r"\bwie (?:baue|bastle|mache) ich eine (?:bombe|rohrbombe|sprengfalle)\b",
            r"\bcomment (?:fabriquer|faire|construire) une bombe\b(?! (?:de bain|à graines|de graines))",
            r"\bc[oó]mo (?:hacer|fabricar|construir) una bomba\b(?! de (?:baño|humo|semillas|agua))",
        ),
        "malware": (
            r"\b(?:write|create|make|build|code|generate|develop) (?:me )?(?:a |an |some )?"
            r"(?:working |functional |undetectable )?(?:ransomware|keylogger|rootkit|botnet"
            rf"|credential stealer|info-?stealer|self-spreading worm)\b{_DEFENSIVE}",
            r"\b(?:encrypt|lock) (?:all )?(?:the )?(?:victim'?s?|their) files and "
            r"(?:demand|ask for) (?:a )?ransom\b",
        ),
    }
    block = [_rx(category, p) for category, patterns in harmful.items() for p in patterns]
    block += [_rx("prompt_injection", p, "untrusted") for p in injection]
    return RulesSpec(block=tuple(block))
