"""Deployable services, one module each: thin FastStream wiring over ``pipeline``."""
