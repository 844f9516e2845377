"""Turnstile's library, one subpackage per job, layered (bottom to top): ``log``, ``inference``,
``dialects``, ``episodes``, ``gateway`` and ``examples``, ``runners``, ``batches``, ``materialize``,
``replay``/``training``/``sql``, ``dev``; ``errors`` and ``settings`` under all of them. A package imports
only from the layers below it (the contracts are in pyproject.toml; CI runs ``lint-imports``)."""
