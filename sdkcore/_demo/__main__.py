"""``python -m sdkcore._demo`` runs the demo (as ``sdkcore demo`` does)."""

from . import main

raise SystemExit(main())
