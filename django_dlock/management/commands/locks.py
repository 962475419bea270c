"""``manage.py locks``: list, show, break and check locks on every configured backend.

Exit codes: 0 done; 1 nothing matched (``show``, ``break``) or the break was
not confirmed; 2 bad usage or ``DLOCK_BACKENDS`` settings; 3 a backend did
not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ... import holders
from ...checks import check_backends
from ...exceptions import DLockError, LockConfigurationError
from ...handler import locks

NOTHING_MATCHED = 1
USAGE = 2
UNAVAILABLE = 3

#: ``--watch`` with no number refreshes this often (seconds).
WATCH_INTERVAL = 2.0

_CLEAR = "\x1b[H\x1b[2J"


class Command(BaseCommand):
    # An operator breaking a stuck lock must not be stopped by an unrelated
    # system check; handle() runs django_dlock's own.
    requires_system_checks: list[str] = []
    help = (
        "List, show, break and check distributed locks. With no subcommand: list. "
        "Exit codes: 0 done; 1 nothing matched or not confirmed; 2 bad usage or settings; "
        "3 a backend did not answer."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        try:
            aliases = list(locks)
        except LockConfigurationError:
            aliases = []  # handle() reports what is wrong
        self._list_options(parser, aliases, default=True)
        sub = parser.add_subparsers(dest="subcommand", metavar="{list,show,break,check}")

        listing = sub.add_parser("list", help="Live leases as a table (the default).")
        self._list_options(listing, aliases, default=False)

        show = sub.add_parser("show", help="Everything known about the lease on NAME.")
        show.add_argument("name", help="The lock's exact name.")
        self._backend_option(show, aliases, default=False)
        show.add_argument("--json", action="store_true", default=argparse.SUPPRESS)

        brk = sub.add_parser(
            "break",
            help="Delete the lease on NAME (or on every name under --prefix) whoever holds it.",
        )
        brk.add_argument("name", nargs="?", help="The lock's exact name.")
        self._backend_option(brk, aliases, default=False)
        brk.add_argument(
            "--prefix",
            default=argparse.SUPPRESS,
            help="Break every lease whose name starts with PREFIX (needs --yes).",
        )
        brk.add_argument(
            "--slot",
            type=int,
            default=None,
            metavar="TOKEN",
            help="NAME is a semaphore or read/write lock: free its slot with this fencing token.",
        )
        brk.add_argument(
            "--all-slots",
            action="store_true",
            help="NAME is a semaphore or read/write lock: free every slot.",
        )
        brk.add_argument(
            "--yes",
            "-y",
            "--no-input",
            "--noinput",
            action="store_true",
            dest="yes",
            help="Do not ask for confirmation.",
        )

        check = sub.add_parser(
            "check", help="Ping each backend: server version, round trip, whether it answers."
        )
        self._backend_option(check, aliases, default=False)
        check.add_argument("--json", action="store_true", default=argparse.SUPPRESS)

    @staticmethod
    def _backend_option(parser: CommandParser, aliases: list[str], *, default: bool) -> None:
        # On the subcommands the defaults are suppressed, so that
        # `locks --backend x list` keeps the value given before the subcommand.
        parser.add_argument(
            "--backend",
            choices=aliases or None,
            default=None if default else argparse.SUPPRESS,
            help="Only this backend alias (default: every configured backend).",
        )

    def _list_options(self, parser: CommandParser, aliases: list[str], *, default: bool) -> None:
        self._backend_option(parser, aliases, default=default)
        parser.add_argument(
            "--prefix",
            default=None if default else argparse.SUPPRESS,
            help="Only names that start with PREFIX.",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            default=False if default else argparse.SUPPRESS,
            help="Print JSON instead of a table.",
        )
        parser.add_argument(
            "--watch",
            nargs="?",
            type=_positive_seconds,
            const=WATCH_INTERVAL,
            default=None if default else argparse.SUPPRESS,
            metavar="SECONDS",
            help=f"Refresh every SECONDS (default {WATCH_INTERVAL:g}) until interrupted.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        problems = [message for message in check_backends() if message.is_serious()]
        if problems:
            raise CommandError(
                "DLOCK_BACKENDS is misconfigured:\n"
                + "\n".join(f"  {message.id}: {message.msg}" for message in problems),
                returncode=USAGE,
            )
        subcommand = options.get("subcommand") or "list"
        backend = options.get("backend")
        if subcommand == "list":
            prefix = options.get("prefix") or ""
            if options.get("watch") is not None:
                self.watch(backend, prefix, options["watch"], options["json"])
            else:
                self.list_locks(backend, prefix, options["json"])
        elif subcommand == "show":
            self.show_lock(options["name"], backend, options.get("json", False))
        elif subcommand == "break":
            if options.get("slot") is not None or options.get("all_slots"):
                self.break_slots(options.get("name"), backend, options.get("slot"), options["yes"])
            else:
                self.break_locks(
                    options.get("name"), backend, options.get("prefix"), options["yes"]
                )
        else:
            self.check_backends(backend, options.get("json", False))

    # --- list -----------------------------------------------------------------------

    def list_locks(self, backend: str | None, prefix: str, as_json: bool) -> None:
        with _collector_paused():
            listing = holders.current_holders(backend, prefix)
            semaphores = holders.current_semaphores(backend, prefix)
            output = self.render(listing, backend, prefix, as_json, semaphores=semaphores)
        listing.errors.update(semaphores.errors)
        for alias, error in listing.errors.items():
            self.stderr.write(f"{alias}: {error}")
        self.stdout.write(output)
        self.fail_for(listing)

    def render(
        self,
        listing: holders.Listing,
        backend: str | None,
        prefix: str,
        as_json: bool,
        with_errors: bool = False,
        semaphores: holders.SemaphoreListing | None = None,
    ) -> str:
        """The listing as JSON or as a table; ``with_errors`` puts backends' errors first.

        Semaphores and read/write locks follow the mutexes: in JSON as more
        objects (with ``kind``, ``limit``, ``mode``, ``waiting``, ``parked``),
        in a table as a second table, one row per holder.
        """
        now = listing.taken_at
        found = semaphores.semaphores if semaphores is not None else []
        if as_json:
            objects = [holders.as_json(info, now) for info in listing.holders]
            objects += [text for info in found for text in holders.semaphore_json(info, now)]
            return "[" + ",".join(objects) + "]"
        lines = [
            self.style.ERROR(f"{alias}: {error}")
            for alias, error in (listing.errors.items() if with_errors else ())
        ]
        if not listing.holders and not found:
            where = f" on backend {backend!r}" if backend else ""
            under = f" with names starting {prefix!r}" if prefix else ""
            return "\n".join([*lines, f"No locks held{where}{under}."])
        if listing.holders:
            header, *rows = holders.table(
                (holders.columns(info, now) for info in listing.holders), holders.COLUMNS
            )
            lines += [self.style.MIGRATE_HEADING(header), *rows]
        if found:
            header, *rows = holders.table(
                (row for info in found for row in holders.semaphore_rows(info, now)),
                holders.SEMAPHORE_COLUMNS,
            )
            if listing.holders:
                lines.append("")
            lines += [
                "Semaphores and read/write locks:",
                self.style.MIGRATE_HEADING(header),
                *rows,
            ]
        return "\n".join(lines)

    def fail_for(self, listing: holders.Listing) -> None:
        if listing.errors:
            raise CommandError(
                f"Backend(s) {', '.join(listing.errors)} did not answer.", returncode=UNAVAILABLE
            )

    def watch(self, backend: str | None, prefix: str, interval: float, as_json: bool) -> None:
        in_place = self.stdout.isatty() and not as_json
        try:
            while True:
                listing = holders.current_holders(backend, prefix)
                semaphores = holders.current_semaphores(backend, prefix)
                listing.errors.update(semaphores.errors)
                if as_json:
                    # One JSON document per refresh, each on one line (NDJSON).
                    for alias, error in listing.errors.items():
                        self.stderr.write(f"{alias}: {error}")
                    self.stdout.write(
                        self.render(listing, backend, prefix, True, semaphores=semaphores)
                    )
                else:
                    # On a screen that is redrawn, errors belong in the frame.
                    frame = self.render(
                        listing, backend, prefix, False, with_errors=True, semaphores=semaphores
                    )
                    stamp = listing.taken_at.strftime("%Y-%m-%d %H:%M:%S UTC")
                    title = f"Every {interval:g}s: locks list" + "".join(
                        f" --{option} {value}"
                        for option, value in (("backend", backend), ("prefix", prefix))
                        if value
                    )
                    self.stdout.write(
                        (_CLEAR if in_place else "") + f"{title}    {stamp}\n\n{frame}\n"
                    )
                self.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            self.stdout.write("")

    # --- show -----------------------------------------------------------------------

    def show_lock(self, name: str, backend: str | None, as_json: bool) -> None:
        listing = holders.find_holders(name, backend)
        semaphores = holders.find_semaphores(name, backend)
        now = listing.taken_at
        if as_json:
            self.stdout.write(self.render(listing, backend, "", True, semaphores=semaphores))
        elif semaphores.semaphores:
            self.stdout.write(
                self.render(holders.Listing(), backend, "", False, semaphores=semaphores)
            )
        for info in [] if as_json else listing.holders:
            fields: list[tuple[str, str]] = [
                ("backend", info.backend),
                ("name", info.name),
                ("token", str(info.token)),
                ("acquired at", info.acquired_at.isoformat()),
                ("held for", holders.duration(holders.held_for(info, now))),
                ("expires at", _expires_at(info)),
                ("expires in", holders.duration(info.expires_in)),
            ]
            fields += [(f"holder.{key}", _text(value)) for key, value in info.holder.items()]
            width = max(len(label) for label, _ in fields)
            for label, value in fields:
                self.stdout.write(
                    f"{self.style.MIGRATE_LABEL(label.ljust(width))}  {holders.printable(value)}"
                )
            self.stdout.write("")
        listing.errors.update(semaphores.errors)
        self.fail_for(listing)
        if not listing.holders and not semaphores.semaphores:
            raise CommandError(f"{name!r} is not held{_on(backend)}.", returncode=NOTHING_MATCHED)

    # --- break ----------------------------------------------------------------------

    def break_locks(
        self, name: str | None, backend: str | None, prefix: str | None, yes: bool
    ) -> None:
        if (name is None) == (prefix is None):
            raise CommandError("Give a lock NAME or --prefix PREFIX, not both.", returncode=USAGE)
        if prefix is not None and not yes:
            raise CommandError(
                f"Breaking by --prefix needs --yes. `manage.py locks list --prefix {prefix}` "
                "shows what it would break.",
                returncode=USAGE,
            )
        if name is not None:
            listing = holders.find_holders(name, backend)
        else:
            listing = holders.current_holders(backend, prefix or "")
        for alias, error in listing.errors.items():
            self.stderr.write(f"{alias}: {error}")
        if not listing.holders:
            self.fail_for(listing)
            what = f"{name!r} is not" if name is not None else f"no name starting {prefix!r} is"
            hint = ""
            if name is not None and holders.find_semaphores(name, backend).semaphores:
                hint = (
                    f" {name!r} is a semaphore or read/write lock: free one slot with "
                    "--slot TOKEN (`manage.py locks show NAME` lists them), or --all-slots."
                )
            raise CommandError(
                f"Nothing broken: {what} held as a lock{_on(backend)}.{hint}",
                returncode=NOTHING_MATCHED,
            )
        if not yes:
            self.stdout.write("About to break:")
            self.stdout.write(self.render(listing, backend, prefix or "", False))
            if not self.confirm("Break these leases? Their holders will lose them. [y/N] "):
                raise CommandError("Nothing broken.", returncode=NOTHING_MATCHED)
        broken = 0
        for info in listing.holders:
            try:
                done = holders.break_holder(info)
            except DLockError as e:
                self.stderr.write(f"{info.backend}: {e}")
                listing.errors[info.backend] = e
                continue
            where = f"'{holders.printable(info.name)}' on {info.backend} (token {info.token}"
            if done:
                broken += 1
                label = holders.printable(holders.holder_label(info.holder))
                self.stdout.write(self.style.SUCCESS(f"Broke {where}, held by {label})."))
            else:
                self.stdout.write(
                    self.style.WARNING(f"Left {where}): released or taken again since listed.")
                )
        if broken == 0:
            self.fail_for(listing)
            raise CommandError("Nothing broken.", returncode=NOTHING_MATCHED)
        self.fail_for(listing)

    def break_slots(
        self, name: str | None, backend: str | None, token: int | None, yes: bool
    ) -> None:
        """Free one slot (``--slot TOKEN``) or every slot (``--all-slots``) of semaphore NAME."""
        if name is None:
            raise CommandError(
                "--slot and --all-slots need the semaphore's NAME.", returncode=USAGE
            )
        listing = holders.find_semaphores(name, backend)
        for alias, error in listing.errors.items():
            self.stderr.write(f"{alias}: {error}")
        chosen = [
            (info, holder)
            for info in listing.semaphores
            for holder in info.holders
            if token is None or holder.token == token
        ]
        if not chosen:
            self.fail_for(listing)  # type: ignore[arg-type]
            what = f"with token {token} " if token is not None else ""
            raise CommandError(
                f"Nothing broken: semaphore {name!r} has no slot {what}held{_on(backend)}.",
                returncode=NOTHING_MATCHED,
            )
        if not yes:
            self.stdout.write("About to free:")
            rows = [holders.semaphore_rows(info, listing.taken_at) for info, _ in chosen]
            header, *lines = holders.table(
                (row for info_rows in rows for row in info_rows if row[5] in
                 {str(h.token) for _, h in chosen}),
                holders.SEMAPHORE_COLUMNS,
            )  # fmt: skip
            self.stdout.write("\n".join([header, *lines]))
            if not self.confirm("Free these slots? Their holders will lose them. [y/N] "):
                raise CommandError("Nothing broken.", returncode=NOTHING_MATCHED)
        freed = 0
        for info, holder in chosen:
            try:
                done = holders.break_slot(info, holder.token)
            except DLockError as e:
                self.stderr.write(f"{info.backend}: {e}")
                continue
            where = f"'{holders.printable(name)}' on {info.backend} (token {holder.token}"
            if done:
                freed += 1
                label = holders.printable(holders.holder_label(holder.holder))
                self.stdout.write(
                    self.style.SUCCESS(f"Freed the slot of {where}, held by {label}).")
                )
            else:
                self.stdout.write(self.style.WARNING(f"Left {where}): released since listed."))
        if freed == 0:
            raise CommandError("Nothing broken.", returncode=NOTHING_MATCHED)

    def confirm(self, question: str) -> bool:
        try:
            answer = input(question)
        except EOFError:
            return False
        return answer.strip().lower() in ("y", "yes")

    # --- check ----------------------------------------------------------------------

    def check_backends(self, backend: str | None, as_json: bool) -> None:
        results: list[dict[str, Any]] = []
        for alias in holders.aliases(backend):
            backend_obj = locks[alias]
            result: dict[str, Any] = {
                "backend": alias,
                "class": backend_obj.path,
                "ok": False,
                "version": None,
                "latency_ms": None,
                "warnings": [],
                "error": None,
            }
            try:
                status = backend_obj.ping()
            except DLockError as e:
                result["error"] = str(e)
            else:
                result.update(
                    ok=True,
                    version=status.version,
                    latency_ms=round(status.latency * 1000, 3),
                    warnings=list(status.warnings),
                )
            results.append(result)
        if as_json:
            self.stdout.write(json.dumps(results))
        else:
            rows = []
            for r in results:
                if r["ok"]:
                    state = "ok" + (f", {len(r['warnings'])} warning(s)" if r["warnings"] else "")
                    rows.append(
                        (
                            r["backend"],
                            r["class"],
                            r["version"],
                            f"{r['latency_ms']:.1f} ms",
                            state,
                        )
                    )
                else:
                    rows.append((r["backend"], r["class"], "-", "-", "FAILED"))
            header, *lines = holders.table(
                rows, ("BACKEND", "CLASS", "SERVER", "ROUND TRIP", "STATUS")
            )
            self.stdout.write(self.style.MIGRATE_HEADING(header))
            for line, r in zip(lines, results, strict=True):
                style = self.style.SUCCESS if r["ok"] and not r["warnings"] else self.style.WARNING
                self.stdout.write(style(line) if r["ok"] else self.style.ERROR(line))
                for warning in r["warnings"]:
                    self.stdout.write(self.style.WARNING(f"  {r['backend']}: {warning}"))
                if r["error"]:
                    self.stdout.write(self.style.ERROR(f"  {r['backend']}: {r['error']}"))
        failed = [r["backend"] for r in results if not r["ok"]]
        if failed:
            raise CommandError(
                f"Backend(s) {', '.join(failed)} did not answer.", returncode=UNAVAILABLE
            )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a listing is built.

    A listing allocates a few objects per lease and frees none of them until
    it is printed, so the collector's passes over a growing heap find nothing
    (they cost about an eighth of listing 100,000 leases when measured).
    Reference counting still frees everything as usual.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be a positive number")
    return value


def _expires_at(info: Any) -> str:
    return info.expires_at.isoformat() if info.expires_in != float("inf") else "never"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _on(backend: str | None) -> str:
    return f" on backend {backend!r}" if backend else ""
