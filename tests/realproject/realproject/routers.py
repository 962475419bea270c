"""The ledger's accounts live on the second database, with a lease table of their own."""

from typing import Any

LEDGER_MODELS = {("inventory", "account")}


class LedgerRouter:
    def _db(self, model: Any) -> str | None:
        meta = model._meta
        return "ledger" if (meta.app_label, meta.model_name) in LEDGER_MODELS else None

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self._db(model)

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self._db(model)

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if (app_label, model_name) in LEDGER_MODELS:
            return db == "ledger"
        if db == "ledger":
            # The "ledger" lock backend keeps its leases in this database.
            return app_label == "django_dlock"
        return None
