"""Every compression method, registered by importing its module (each decorates its handler with
registry.register). A new method is one new module and one line here."""

from leanlm.compress.distill import step  # noqa: F401
from leanlm.compress.quant import awq, gptq, llm_int8, rtn, smoothquant  # noqa: F401
from leanlm.compress.sparse import magnitude, sparsegpt, structured, taylor, wanda  # noqa: F401
