"""``towerrec`` command line: train | replay | config | plan | bench | data | sweep | tune |
scaling | export | predict | nas | distill.

User errors (bad config, missing files, bad data) print one ``error:`` line
and exit with status 2; anything else is a bug and shows its traceback. Warnings
print as one line, as the log's own (time, WARNING, and ``towerrec`` or the
warning's category), without the file and source line Python shows by default. A
reader that closes stdout early (``towerrec data info DIR | head``) ends the
command quietly with status 141, as a process stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import time
import warnings

from towerrec.cli import (
    bench,
    config,
    data,
    distill,
    nas,
    plan,
    replay,
    scaling,
    serve,
    sweep,
    train,
    tune,
)

__all__ = ["build_parser", "main"]

log = logging.getLogger("towerrec")

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ImportError)
STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towerrec", description="Train and plan DLRM-family recommendation models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (
        train,
        replay,
        config,
        plan,
        bench,
        data,
        sweep,
        tune,
        scaling,
        serve,
        nas,
        distill,
    ):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Our own logger at INFO; libraries (FBGEMM logs to the root logger) at WARNING.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    previous, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed stdout fails here, not in the flush at exit
        return code
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if _stdout_open():
            raise  # another pipe broke: not the reader of our output leaving
        # Later writes (the flush at exit included) go nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return STDOUT_CLOSED
    finally:
        warnings.formatwarning = previous


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """A warning as the command line prints it (module docstring)."""
    source = "towerrec" if f"{os.sep}towerrec{os.sep}" in filename else category.__name__
    return f"{time.strftime('%H:%M:%S')} WARNING {source}: {message}\n"


def _stdout_open() -> bool:
    """False when stdout's reader is gone (a pipe reports an error condition), or when
    this platform cannot tell (Windows has no ``select.poll``): the broken pipe is then
    taken to be stdout's."""
    if sys.platform == "win32":
        return False
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return not any(events & select.POLLERR for _, events in poller.poll(0))
