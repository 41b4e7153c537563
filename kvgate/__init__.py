"""kvgate's front door (`cli`, `stack`) and shared leaves (`clock`, `state`, the `v1` protocol stubs).

Imports nothing, so importing a leaf such as `kvgate.clock` never pulls in the front door.
"""
