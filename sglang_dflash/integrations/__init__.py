"""Hosts for the DFlash worker other than our own engine (SGLang)."""
