"""Tiny Shakespeare preparation, the character tokenizer and batch sampling."""
