#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    from django.core.management import execute_from_command_line

    try:
        try:
            execute_from_command_line(sys.argv)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be caught (even on exit())
    except BrokenPipeError:
        # The reader went away (`| head`): a command's output is not worth a traceback. Point
        # stdout at /dev/null so the interpreter's own flush at exit finds nothing to complain of.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)  # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    main()
