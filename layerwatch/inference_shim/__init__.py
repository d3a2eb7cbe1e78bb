"""The inference shim: the gated model and everything that runs it.

- runtime/: the model, the skip policy, the generation engine, checkpoint, gate and tokenizer IO;
- service/: `layerwatch serve`, the OpenAI-compatible HTTP shim with its metrics and gate frames;
- offline/: corpus, training, gate training, evaluation and calibration on text files.
"""
