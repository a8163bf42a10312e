"""KubeRL operator: kopf handlers over pure child builders and status aggregation."""
