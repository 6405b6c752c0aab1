"""Chat templates written for mt_env (Jinja, in the formats the model families use)."""
