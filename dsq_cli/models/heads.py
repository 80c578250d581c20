"""The classification head every GLUE encoder carries.

Each encoder registers one sentence-classification head under ``HEAD_NAME``; the trainer runs
``model(tokens, features_only=True, classification_head_name=HEAD_NAME)``.
"""

HEAD_NAME = "glue"
