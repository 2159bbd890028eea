"""The Llama-family model: architecture config, attention, the model, and weight loading."""
