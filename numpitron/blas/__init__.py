"""Which BLAS multiplies: NumPy's own (the reference), or another found installed
(`--blas`). setting.py declares the flag, products.py installs the choice on a built stage."""
