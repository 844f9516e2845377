"""Deployable services, one module each, wiring over ``pipeline`` on one runtime (``runtime``); the
``turnstile`` command (``cli``) is the composition root."""
