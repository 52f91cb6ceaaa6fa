"""Launch and manage sandboxed kernels: Docker provisioner, profiles, session layer."""
