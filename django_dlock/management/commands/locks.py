"""``manage.py locks``: list, show, break and check locks on every configured backend.

Mutexes are listed one row per lease, as they always were; semaphores and
read/write locks follow in a table of their own, one row per holder's slot.
A break of a slot names its fencing token (``--token``), or says
``--all-slots``: a semaphore's holders are peers, and freeing all of them
when one is stuck is rarely what the operator meant.

Exit codes: 0 done; 1 nothing matched (``show``, ``break``) or the break was
not confirmed; 2 bad usage or ``DLOCK_BACKENDS`` settings; 3 a backend did
not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ... import holders
from ..._validation import printable, validate_name
from ...checks import backend_messages
from ...exceptions import LockConfigurationError
from ...handler import locks
from ...lag import lag_notes
from ...pings import ping_within
from .. import formatting

NOTHING_MATCHED = 1
USAGE = 2
UNAVAILABLE = 3
#: The reader of the output went away (128 + SIGPIPE, as a shell reports it).
BROKEN_PIPE = 141

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
            help="Delete the lease on NAME (or on every name under --prefix) whoever holds it; "
            "free one slot of a semaphore or read/write lock with --token.",
        )
        brk.add_argument("name", nargs="?", help="The lock's exact name.")
        self._backend_option(brk, aliases, default=False)
        brk.add_argument(
            "--prefix",
            default=argparse.SUPPRESS,
            help="Break every lease whose name starts with PREFIX (needs --yes; an empty "
            "PREFIX is refused: that is --all).",
        )
        brk.add_argument(
            "--all",
            action="store_true",
            dest="everything",
            help="Break every lease on the backend(s) (needs --yes).",
        )
        brk.add_argument(
            "--token",
            type=int,
            default=None,
            help="Only the lease or slot of NAME with this fencing token (the TOKEN column). "
            "This is how one holder's slot of a semaphore or read/write lock is freed.",
        )
        brk.add_argument(
            "--all-slots",
            action="store_true",
            help="Also free every slot of the semaphores and read/write locks matched "
            "(without it, they are only freed one at a time, by --token).",
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
        check.add_argument(
            "--timeout",
            type=_seconds,
            default=None,
            metavar="SECONDS",
            help="Count a backend that has not answered its ping within SECONDS as down "
            "(default: wait for the client's own timeouts).",
        )

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
            type=_seconds,
            const=WATCH_INTERVAL,
            default=None if default else argparse.SUPPRESS,
            metavar="SECONDS",
            help=f"Refresh every SECONDS (default {WATCH_INTERVAL:g}) until interrupted.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self.run(**options)
        except BrokenPipeError:
            # The reader left (`locks --json | head`): stop quietly, as a
            # command killed by SIGPIPE would, and let no flush at exit fail.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise SystemExit(BROKEN_PIPE) from None

    def run(self, **options: Any) -> None:
        subcommand = options.get("subcommand") or "list"
        backend = options.get("backend")
        # A name no lock can have is bad usage, not a backend's failure.
        try:
            if options.get("name") is not None:
                validate_name(options["name"])
            if options.get("prefix"):
                validate_name(options["prefix"], what="A lock name prefix")
        except (TypeError, ValueError) as e:
            raise CommandError(printable(str(e)), returncode=USAGE) from None
        self.misconfigured = self.find_misconfigured(backend)
        if subcommand == "list":
            prefix = options.get("prefix") or ""
            if options.get("watch") is not None:
                self.watch(backend, prefix, options["watch"], options["json"])
            else:
                self.list_locks(backend, prefix, options["json"])
        elif subcommand == "show":
            self.show_lock(options["name"], backend, options.get("json", False))
        elif subcommand == "break":
            prefix = options.get("prefix")
            if options["everything"]:
                if prefix is not None:
                    raise CommandError("Give --prefix or --all, not both.", returncode=USAGE)
                prefix = ""
            elif prefix == "":
                raise CommandError(
                    "An empty --prefix matches every lease: an unset variable in a script "
                    "gives one. Nothing broken; to break every lease, say --all.",
                    returncode=USAGE,
                )
            self.break_locks(
                options.get("name"),
                backend,
                prefix,
                options["yes"],
                options["token"],
                options["all_slots"],
            )
        else:
            self.check_backends(backend, options.get("json", False), options.get("timeout"))

    # --- list -----------------------------------------------------------------------

    def list_locks(self, backend: str | None, prefix: str, as_json: bool) -> None:
        if as_json:
            errors = self.write_json(backend, prefix)
            self.write_errors(errors)
            self.fail_for(errors)
            return
        with _collector_paused():
            listing = holders.current_holders(backend, prefix)
            output = self.render(listing, backend, prefix, as_json)
        self.write_errors(listing.errors)
        if output:
            self.stdout.write(output)
        self.fail_for(listing.errors)

    def write_json(self, backend: str | None, prefix: str) -> dict[str, Exception]:
        """Write the listing as one JSON array, a batch of leases at a time.

        What ``render(..., as_json=True)`` returns, without holding it: the
        memory used does not grow with the number of leases on a backend
        that lists page by page (Redis). Returns the backends that failed;
        the array stays valid JSON when one fails midway.
        """
        errors: dict[str, Exception] = {}
        now = datetime.now(timezone.utc)
        write = self.stdout.write
        write("[", ending="")
        separator = ""
        with _collector_paused():
            for piece in formatting.iter_json(backend, prefix, now, errors):
                write(separator + piece, ending="")
                separator = ","
        write("]")
        return errors

    def render(
        self,
        listing: holders.Listing,
        backend: str | None,
        prefix: str,
        as_json: bool,
        with_errors: bool = False,
    ) -> str:
        """The listing as JSON or as a table; ``with_errors`` puts backends' errors first."""
        if as_json:
            return formatting.listing_json(listing)
        lines = [
            self.style.ERROR(printable(f"{alias}: {self.failure(alias, error)}"))
            for alias, error in (listing.errors.items() if with_errors else ())
        ]
        if not listing.holders and not listing.slots:
            empty = formatting.nothing_held(listing, backend, prefix)
            return "\n".join(lines + ([empty] if empty else []))
        return "\n".join(lines + formatting.listing_tables(listing, self.style.MIGRATE_HEADING))

    def find_misconfigured(self, backend: str | None) -> dict[str, str]:
        """The backends asked for whose settings fail django-dlock's checks, with why.

        Each is named on stderr now, and the others are still listed,
        checked or broken; the command then ends with exit code 2. Settings
        wrong as a whole (no "default", not a dict) stop it here.
        """
        problems: dict[str | None, list[str]] = {}
        for alias, message in backend_messages():
            if message.is_serious():
                problems.setdefault(alias, []).append(f"{message.id}: {message.msg}")
        if None in problems:
            raise CommandError(
                "DLOCK_BACKENDS is misconfigured:\n"
                + "\n".join(f"  {text}" for text in problems[None]),
                returncode=USAGE,
            )
        found = {
            alias: "misconfigured: " + " ".join(texts)
            for alias, texts in problems.items()
            if alias is not None and alias in holders.aliases(backend)
        }
        for alias, text in found.items():
            self.stderr.write(printable(f"{alias}: {text}"))
        return found

    def write_errors(self, errors: dict[str, Exception]) -> None:
        """Each backend's error on stderr, escaped: a message may quote a lock's name.

        A misconfigured backend was named once already, with its check ids.
        """
        for alias, error in errors.items():
            if alias not in self.misconfigured:
                self.stderr.write(printable(f"{alias}: {formatting.failure_text(error)}"))

    def failure(self, alias: str, error: Exception) -> str:
        return self.misconfigured.get(alias) or formatting.failure_text(error)

    def fail_for(self, errors: dict[str, Exception]) -> None:
        if self.misconfigured:
            raise CommandError(
                f"Backend(s) {', '.join(self.misconfigured)} misconfigured: `manage.py check` "
                "lists what is wrong.",
                returncode=USAGE,
            )
        if errors:
            raise CommandError(
                f"Backend(s) {', '.join(errors)} did not answer.", returncode=UNAVAILABLE
            )

    def watch(self, backend: str | None, prefix: str, interval: float, as_json: bool) -> None:
        in_place = self.stdout.isatty() and not as_json
        try:
            while True:
                if as_json:
                    # One JSON document per refresh, each on one line (NDJSON).
                    self.write_errors(self.write_json(backend, prefix))
                else:
                    listing = holders.current_holders(backend, prefix)
                    # On a screen that is redrawn, errors belong in the frame.
                    frame = self.render(listing, backend, prefix, as_json=False, with_errors=True)
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
        listing = holders.find_holders(name, backend, slots=True)
        now = listing.taken_at
        if as_json:
            self.stdout.write(self.render(listing, backend, "", as_json=True))
        for info in [] if as_json else listing.holders:
            self.write_fields(formatting.show_fields(info, now))
        for slot in [] if as_json else listing.slots:
            self.write_fields(formatting.slot_show_fields(slot, now))
        self.fail_for(listing.errors)
        if not listing.holders and not listing.slots:
            raise CommandError(f"{name!r} is not held{_on(backend)}.", returncode=NOTHING_MATCHED)

    def write_fields(self, fields: list[tuple[str, str]]) -> None:
        width = max(len(printable(label)) for label, _ in fields)
        for label, value in fields:
            label = printable(label)
            self.stdout.write(
                f"{self.style.MIGRATE_LABEL(label.ljust(width))}  {printable(value)}"
            )
        self.stdout.write("")

    # --- break ----------------------------------------------------------------------

    def break_locks(
        self,
        name: str | None,
        backend: str | None,
        prefix: str | None,
        yes: bool,
        token: int | None = None,
        all_slots: bool = False,
    ) -> None:
        if (name is None) == (prefix is None):
            raise CommandError(
                "Give a lock NAME, --prefix PREFIX or --all: one of them.", returncode=USAGE
            )
        if token is not None and name is None:
            raise CommandError(
                "--token needs a lock NAME: tokens count per name.", returncode=USAGE
            )
        if token is not None and all_slots:
            raise CommandError("Give --token or --all-slots, not both.", returncode=USAGE)
        if prefix is not None and not yes:
            shown = f" --prefix {formatting.shell_quote(prefix)}" if prefix else ""
            raise CommandError(
                f"Breaking by {'--prefix' if prefix else '--all'} needs --yes. "
                f"`manage.py locks list{shown}` shows what it would break.",
                returncode=USAGE,
            )
        if name is not None:
            listing = holders.find_holders(name, backend, slots=True)
        else:
            listing = holders.current_holders(backend, prefix or "")
        self.write_errors(listing.errors)
        # Rows with no holder (only waiters or parked calls) have no slot to free.
        held = [slot for slot in listing.slots if slot.lease is not None]
        left: list[holders.Slot] = []
        if token is not None:
            listing.holders = [info for info in listing.holders if info.token == token]
            held = [slot for slot in held if slot.lease is not None and slot.lease.token == token]
        elif not all_slots:
            left, held = held, []
        listing.slots = held
        if not listing.holders and not listing.slots:
            self.fail_for(listing.errors)
            if left:
                raise CommandError(
                    f"Nothing broken: {formatting.slots_left(left)}", returncode=USAGE
                )
            if token is not None:
                what = f"{name!r} has no lease or slot with token {token}"
            elif name is not None:
                what = f"{name!r} is not held"
            elif prefix:
                what = f"no name starting {prefix!r} is held"
            else:
                what = "no lease is held"
            raise CommandError(
                f"Nothing broken: {what}{_on(backend)}.", returncode=NOTHING_MATCHED
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
            except Exception as e:
                self.write_errors({info.backend: e})
                listing.errors[info.backend] = e
                continue
            where = f"'{printable(info.name)}' on {info.backend} (token {info.token}"
            if done:
                broken += 1
                label = printable(holders.holder_label(info.holder))
                self.stdout.write(self.style.SUCCESS(f"Broke {where}, held by {label})."))
            else:
                self.stdout.write(
                    self.style.WARNING(f"Left {where}): released or taken again since listed.")
                )
        for slot in listing.slots:
            lease = slot.lease
            if lease is None:  # not kept above; for the type checker
                continue
            try:
                done = holders.break_slot(slot)
            except Exception as e:
                self.write_errors({lease.backend: e})
                listing.errors[lease.backend] = e
                continue
            where = (
                f"{holders.slot_label(slot)} '{printable(lease.name)}' "
                f"on {lease.backend} (token {lease.token}"
            )
            if done:
                broken += 1
                label = printable(holders.holder_label(lease.holder))
                self.stdout.write(self.style.SUCCESS(f"Freed {where}, held by {label})."))
            else:
                self.stdout.write(
                    self.style.WARNING(f"Left {where}): released or expired since listed.")
                )
        if left:
            self.stdout.write(self.style.WARNING(f"Left alone: {formatting.slots_left(left)}"))
        if broken == 0:
            self.fail_for(listing.errors)
            raise CommandError("Nothing broken.", returncode=NOTHING_MATCHED)
        self.fail_for(listing.errors)

    def confirm(self, question: str) -> bool:
        try:
            answer = input(question)
        except EOFError:
            return False
        return answer.strip().lower() in ("y", "yes")

    # --- check ----------------------------------------------------------------------

    def check_backends(
        self, backend: str | None, as_json: bool, timeout: float | None = None
    ) -> None:
        results: list[dict[str, Any]] = []
        for alias in holders.aliases(backend):
            result: dict[str, Any] = {
                "backend": alias,
                "class": str(locks.settings[alias].get("BACKEND")),
                "ok": False,
                "version": None,
                "latency_ms": None,
                "warnings": [],
                "error": None,
            }
            if alias in self.misconfigured:
                result["error"] = self.misconfigured[alias]
                results.append(result)
                continue
            try:
                backend_obj = locks[alias]
                result["class"] = backend_obj.path
                status = ping_within(backend_obj, timeout)
            except Exception as e:  # reported by alias, never a traceback
                result["error"] = formatting.failure_text(e)
            else:
                result.update(
                    ok=True,
                    version=status.version,
                    latency_ms=round(status.latency * 1000, 3),
                    warnings=list(status.warnings),
                )
                try:
                    result["warnings"] += lag_notes(backend_obj)
                except Exception as e:
                    result["warnings"].append(
                        f"could not read the watchdogs' lag notes: {formatting.failure_text(e)}"
                    )
            results.append(result)
        if as_json:
            self.stdout.write(json.dumps(results))
        else:
            header, *lines = formatting.check_table(results)
            self.stdout.write(self.style.MIGRATE_HEADING(header))
            for line, r in zip(lines, results, strict=True):
                style = self.style.SUCCESS if r["ok"] and not r["warnings"] else self.style.WARNING
                self.stdout.write(style(line) if r["ok"] else self.style.ERROR(line))
                for warning in r["warnings"]:
                    self.stdout.write(
                        self.style.WARNING(printable(f"  {r['backend']}: {warning}"))
                    )
                if r["error"]:
                    self.stdout.write(
                        self.style.ERROR(printable(f"  {r['backend']}: {r['error']}"))
                    )
        self.fail_for({})
        failed = [r["backend"] for r in results if not r["ok"]]
        if failed:
            raise CommandError(
                f"Backend(s) {', '.join(failed)} did not answer, or cannot lock: see above.",
                returncode=UNAVAILABLE,
            )


def _seconds(value: str) -> float:
    """``--timeout``'s and ``--watch``'s argument: a positive number of seconds.

    Bounded: ``time.sleep`` and threading's waits refuse more.
    """
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    # threading's waits take up to TIMEOUT_MAX seconds (about 292 years).
    if not 0 < seconds < threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds below {threading.TIMEOUT_MAX:.0f}, "
            f"not {value!r}"
        )
    return seconds


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a listing is built or streamed.

    A listing allocates a few objects per lease and frees none of them until
    it is printed (a streamed one: until its batch is written), so the
    collector's passes find nothing (they cost about an eighth of listing
    100,000 leases as a table, and a fifth of streaming 200,000 as JSON, when
    measured). Reference counting still frees everything as usual, so a
    streamed listing's memory stays that of a page.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _on(backend: str | None) -> str:
    return f" on backend {backend!r}" if backend else ""
