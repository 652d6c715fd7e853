"""Where a process runs: device detection, the CPU device torchtitan lacks, the Neuron environment.

Nothing here imports torchtitan at import time: the device shim must be in place before torchtitan's
import-time device detection runs (see ``device_autoload``).
"""
