"""The SageMaker server: configuration from SageMaker's environment, the FastAPI app and
the vLLM engine it fronts (``python -m serving``)."""
