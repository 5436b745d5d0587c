"""One ComponentResource per unit of the stack."""
