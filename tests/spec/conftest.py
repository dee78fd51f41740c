from tests.engine.conftest import tiny_llm, tiny_models  # noqa: F401  (shared fixtures)
