"""Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz, and the owners that
orthogonalise whole matrices when ZeRO has split them. Chapter 10 of the book opens this folder."""
