from sidecar.sim.cli import main

main()
