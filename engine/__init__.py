"""pdserve engine: paged-KV Llama inference with continuous batching and P/D hand-off."""
from engine.errors import RequestValidationError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.request import EngineRequest, KVPull, Phase, RequestOutput, StepResult
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.tp import TPContext, init_tp, kv_head_range

__all__ = ["EngineRequest", "KVPull", "LLMEngine", "ModelConfig", "Phase",
           "RequestOutput", "RequestValidationError", "SamplingParams", "StepResult",
           "TPContext", "Tokenizer", "init_tp", "kv_head_range"]
