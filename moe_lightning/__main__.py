from moe_lightning.commands.main import main

main()
