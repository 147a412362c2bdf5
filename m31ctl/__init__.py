"""m31ctl: declarative recipes and a launcher for serving MiniMax-M3.1-Flash with vLLM."""

__version__ = "0.1.0"
