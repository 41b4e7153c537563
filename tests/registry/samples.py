"""Small valid documents that tests combine and bend."""

POOL = """
apiVersion: kvgate/v1
kind: Pool
metadata: {name: local}
spec:
  provider: local
  offers: [{instance_type: slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}]
"""

MODEL = """
apiVersion: kvgate/v1
kind: Model
metadata: {name: tiny}
spec:
  source: builtin:tiny-llama
"""
