"""What depends on the machine: compiled CPU kernels, devices, optional imports, fault points."""
