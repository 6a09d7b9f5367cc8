from loaderplug.cli import main

raise SystemExit(main())
