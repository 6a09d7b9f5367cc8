from loaderplug.cli.commands import main

raise SystemExit(main())
