"""Collectives and their byte accounting."""
