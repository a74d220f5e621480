"""Pure builders: InferenceModel spec -> Kubernetes manifests (plain dicts), no API client."""
