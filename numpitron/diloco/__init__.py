"""DiLoCo (Douillard et al. 2023): R replicas train apart for H inner steps, then average
how far each moved (the pseudo-gradient) and take one outer Nesterov step together.
Chapter 18 of the book opens this folder."""
