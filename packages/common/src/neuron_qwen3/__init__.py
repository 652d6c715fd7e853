"""The Trainium recipe's config names, from whichever backend packages are installed.

``torchrun ... -m torchtitan.train --module neuron_qwen3 --config native_qwen3_4b``
works as in the recipe: each backend registers its recipe configs under the
``qwen3_titan.recipes`` entry-point group, and this module forwards to them.
"""
