"""The registry's own stores: `SqliteRegistryStore` and `PostgresRegistryStore` (the `RegistryStore`
protocol is in `registry.base`), their migrations and the statements both run (`sql`).

They build on the shared SQL plumbing of `registry.db`; `REGISTRY_STORE` names both for
`registry.db.stores.open_store`.
"""

from registry.base import RegistryStore
from registry.db.stores import StoreKind
from registry.store.migrations import MIGRATIONS
from registry.store.postgres import PostgresRegistryStore
from registry.store.sqlite import SqliteRegistryStore

REGISTRY_STORE: StoreKind[RegistryStore] = StoreKind(
    "registry", sqlite=SqliteRegistryStore.open, postgres=PostgresRegistryStore.open
)

__all__ = ["MIGRATIONS", "REGISTRY_STORE", "PostgresRegistryStore", "SqliteRegistryStore"]
