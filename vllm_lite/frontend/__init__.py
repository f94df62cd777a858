"""The API side: AsyncEngineClient, input and output processing (and, later, the OpenAI server)."""
