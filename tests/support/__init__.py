"""Plain helpers and constants shared by the tests, one module per concern (fixtures stay in the
conftest.py files, where pytest finds them; the public testing API is agentrt.testing):

- paths: ROOT, SHARED, shared_path, load_case (the repository and ../shared/testdata)
- models: make_tiny_model, chat_ids, finish_all (tiny models, chat prompts, stepping an engine)
- api: sse_chunks (streaming requests to the OpenAI API)
- ray_cluster: start_local_ray
- fuzz: Hypothesis strategies for constraint and API fuzzing, and memory_cap
- sql: the awkward-identifier database, random grammar sentences and token walks (SQL tests)

Import as `from tests.support.paths import ...`: pytest puts the repository root on sys.path
(`pythonpath = ["."]` in pyproject.toml), so `pytest` and `python -m pytest` both work.
"""
