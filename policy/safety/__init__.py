"""Safety policy evaluation: what the guard cascade's result means under a tenant's policy version."""
