"""STAND-IN for ``rebel.core`` (see ``rebel/_runtime.py``): the mega-cache and the torch.compile
backend the vLLM-model path uses."""
