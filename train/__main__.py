import sys

from jaxpar.train.cli import main

sys.exit(main())
