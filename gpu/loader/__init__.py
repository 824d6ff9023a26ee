"""Model loaders: GGUF files and Hugging Face directories, into one fused Llama weight layout
(`load.load_model`)."""
