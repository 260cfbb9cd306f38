"""quantlab: what quantizing an LLM costs in quality, measured on the shipped artifact.

Importing the package is cheap: torch, transformers and ModelOpt load only when a stage needs them.
"""
from quantlab.errors import QuantlabError

__version__ = "0.1.0"
__all__ = ["QuantlabError", "__version__"]
