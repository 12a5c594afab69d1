"""Gradient compression a trainer applies before its values reach the node: FediAC, top-k, fp16.

FediAC (consensus sparsification) and top-k run in the trainer as two synchronous rounds over
integer tensors registered with the node (``session.py``); fp16 is a wire format the nodes apply
to float chunks. Nothing is imported here, so importing one module costs only that module.
"""
