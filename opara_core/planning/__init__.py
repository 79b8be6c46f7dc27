"""Planning: DAGs, launch orders, stream policies and plans. Imports no torch."""
