"""Starting engines (eyas, SGLang, vLLM) here or over ssh, and reading what reached their processes."""
