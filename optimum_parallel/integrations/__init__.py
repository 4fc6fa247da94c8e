"""Integrations with other libraries; every contact with their private internals lives here."""
