"""``python -m consumers.cli``: the ``turnstile`` command."""

from consumers.cli import main

main()
