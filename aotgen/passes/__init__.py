"""Build passes: transforms between loading a checkpoint and compiling its graphs.

A pass is a plain function. Graph passes take and return an `ExportedProgram`
(`fn(ep, options) -> ep`), which keeps them model-agnostic: they find nodes (e.g.
`aten.linear`) and swap in other ops and constants, never editing the model definition.
They must keep every graph's signature and the KV-cache contract unchanged, so the
runtime runs their output with no new code.
"""
