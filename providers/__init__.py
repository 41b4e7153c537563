"""One `Provider` interface (modelled on Karpenter's CloudProvider) and its implementations: fake,
local, aws, kubernetes. Cloud SDKs are imported only inside the implementation that needs them.
Built in the providers issue."""
