"""Remote-code ChatGLM2, ChatGLM3 and GLM-4: the adapter that patches them where they are
(adapter.py) and the converter that rewrites them as native transformers GLM (convert.py)."""

from .adapter import ChatGLMFamily

__all__ = ["ChatGLMFamily"]
