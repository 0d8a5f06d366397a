"""The policy network and where it comes from: building and loading it (`build`), model names, folders, runs and the
hub (`sources`), the tiny local Llama (`tiny`), stand-ins of the published shapes (`standin`), the packaged real model
(`packaged`), CPU attention without copies (`attention`), serving it in vLLM (`vllm_engine`), and what it needs in
memory (`memory`). A new model source goes here."""
