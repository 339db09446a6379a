"""The default zero-shot one-token judge: the served default model (SmolLM2-135M-Instruct) asked whether a
text is unsafe, answering "safe" or "unsafe".

It does not tell harmful from benign: on 10 obviously harmful and 10 benign prompts (vLLM, bfloat16, this
prompt) its P(unsafe) was 0.05-0.14 for the harmful and 0.03-0.12 for the benign (means 0.097 and 0.067,
AUROC 0.77 on those 20), so at any threshold above 0.15 it flags none of them: it always leans "safe".
Only the mechanics are real; a trained guard (or the rules stage) must do the judging.

Label variants, each one token in SmolLM2's tokenizer (checked when a guard is built): safe "safe" (18437),
" safe", "Safe", " Safe"; unsafe "uns" (10082, the first token of "unsafe" = "uns" + "afe"), " uns", and
" unsafe", which is one token of its own (20408). "Uns" and " Uns" are two tokens ("Un" + "s") and are left
out, as is "Un", the first token of "Unsafe": it starts too many other words to stand for the label.
"""

from __future__ import annotations

from registry.models import GuardModelSpec

# The default model as `lockgate models prepare` builds it and the registry publishes it: the version is the
# first 12 hex digits of its weights' sha256 (registry/default_model.py).
DEFAULT_MODEL_REF = "SmolLM2-135M-Instruct@7ef915c9bf9d"

JUDGE_PROMPT = """\
Is the following text unsafe (asking for or giving help to cause serious harm\
{% if categories %}; categories: {{ categories }}{% endif %})?

Text: "{{ content }}"

Answer with one word: safe or unsafe."""

SAFE_VARIANTS = ("safe", " safe", "Safe", " Safe")
UNSAFE_VARIANTS = ("uns", " uns", " unsafe")

# The least label mass (P(safe variants) + P(unsafe variants)) that counts as the model answering: below it
# the guard raises GuardError. The base model put 0.11-0.36 of its first token's mass on the labels for this
# prompt on the 20 prompts above (median 0.23), and under 1e-5 on an ordinary chat prompt that does not ask
# the question: 0.02 passes every normal answer with a margin of 5x and rejects a non-answer.
DEFAULT_MIN_LABEL_MASS = 0.02


def judge_spec(model_ref: str = DEFAULT_MODEL_REF) -> GuardModelSpec:
    """The zero-shot judge's spec on the model version `model_ref`."""
    return GuardModelSpec(
        kind="one_token",
        model=model_ref,
        prompt_template=JUDGE_PROMPT,
        safe_tokens=SAFE_VARIANTS,
        unsafe_tokens=UNSAFE_VARIANTS,
    )


DEFAULT_JUDGE_SPEC = judge_spec()
