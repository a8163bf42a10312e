"""The ``kuberl`` command line (``kuberl_cli.main``): above both the workload (``kuberl``, whose local
mode ``kuberl run`` starts) and the operator (``kuberl_operator``, whose builders ``kuberl render``
uses); neither of them imports it."""
